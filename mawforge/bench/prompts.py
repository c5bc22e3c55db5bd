"""The bench prompt suite: the paper's four prompt classes (code, summarization, long-form
writing, reasoning), written for this project. Each class holds a few prompts; repetition r of
a class uses prompt r mod len(class), so a 5-repetition cell cycles through its class.
"""
from __future__ import annotations

from mawforge.errors import FormatError

_ARTICLE = (
    "Mixture-of-Experts language models route every token through a small subset of feed-forward "
    "experts. A model with one hundred and twenty-eight experts per layer may activate only eight "
    "for a given token, so most of its parameters are idle at any moment. Systems that run such "
    "models on machines with less memory than the model's size keep the shared tensors resident and "
    "copy the experts a token needs from disk into a fixed-size cache. The cache helps when "
    "consecutive tokens reuse experts, but a larger cache also takes memory from the page cache and "
    "the operating system, and past a point the machine begins to compress or page memory. "
    "Measurements on a laptop showed that the hit rate kept rising with the cache size while decode "
    "speed first rose and then fell sharply, which means the cache size has to be chosen by measured "
    "latency rather than by hit rate.")

PROMPTS: dict[str, tuple[str, ...]] = {
    "code": (
        "Write a Python function `lru_get(cache, key, load)` that returns cache[key], calling "
        "load(key) on a miss and evicting the least recently used entry when the cache holds more "
        "than 64 items. Use collections.OrderedDict and add a short docstring.",
        "Write a C function that reads `n` bytes at offset `off` from a file descriptor with pread, "
        "retrying on EINTR and on short reads, and returns -1 with errno set on failure.",
        "Explain what this shell pipeline does and rewrite it to be safe with file names that "
        "contain spaces: `find . -name '*.log' | xargs grep -l ERROR | xargs rm`.",
    ),
    "summarization": (
        "Summarize the following passage in three sentences for an engineer who has not read "
        "it:\n\n" + _ARTICLE,
        "Give a one-paragraph summary of the passage below, then list its two main claims as "
        "bullet points.\n\n" + _ARTICLE,
    ),
    "writing": (
        "Write a short story of about four paragraphs about a lighthouse keeper who discovers that "
        "the lamp has started answering her questions in Morse code.",
        "Write a detailed blog post introduction explaining to home users why a computer can feel "
        "slow when its memory is almost full, using a kitchen counter as the running metaphor.",
    ),
    "reasoning": (
        "A cache holds 3 items and uses least-recently-used eviction. The requests are A, B, C, A, "
        "D, B, A, C. Step by step, list the cache contents after each request and count the hits.",
        "A train leaves at 9:40 and travels 210 km at 84 km/h, then waits 12 minutes and travels "
        "another 90 km at 60 km/h. At what time does it arrive? Show your reasoning.",
        "Three boxes are labelled 'apples', 'oranges' and 'mixed', and every label is wrong. You may "
        "take one fruit from one box. Which box do you choose and how do you relabel all three?",
    ),
}
CLASSES = tuple(PROMPTS)


def prompt_for(prompt_class: str, repetition: int) -> str:
    if prompt_class not in PROMPTS:
        raise FormatError(f"unknown prompt class {prompt_class!r}; known: {', '.join(CLASSES)}")
    group = PROMPTS[prompt_class]
    return group[repetition % len(group)]


def chat_request(prompt_class: str, repetition: int, model_id: str, max_tokens: int, seed: int,
                 ignore_eos: bool = True) -> dict:
    """The OpenAI chat request body a row sends: greedy, and by default a fixed completion length
    (ignore_eos) so that repetitions and engines decode the same number of tokens."""
    return {"model": model_id, "messages": [{"role": "user", "content": prompt_for(prompt_class, repetition)}],
            "max_tokens": max_tokens, "temperature": 0.0, "seed": seed, "stream": False,
            "ignore_eos": ignore_eos}
