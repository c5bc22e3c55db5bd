"""llama.cpp's BPE pre-tokenizers, transcribed by a script from src/llama-vocab.cpp of the pinned
sdist (llama_cpp_python 0.3.36): the regexes each pre-tokenizer type applies in turn, and the
`tokenizer.ggml.pre` names that select a type with the flags they set. The strings are llama.cpp's
own (already adapted by it from each tokenizer.json), so its hand-written splitters are chosen by
the same string comparison it makes. Types left out (kimi-k2, afmoe, tiny_aya, whitespace) need
llama.cpp code of their own that MawForge does not reproduce."""

# type -> (regexes applied in order, byte_encode: GPT-2 bytes-to-unicode mapping of each word)
REGEXES: dict[str, tuple[tuple[str, ...], bool]] = {
    "llama3": ((
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ), True),
    "jais2": ((
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}",
    ), True),
    "dbrx": ((
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ), True),
    "deepseek_llm": ((
        "[\r\n]",
        "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
        "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
        "\\s+$",
        "[一-龥ࠀ-一가-퟿]+",
        "\\p{N}+",
    ), True),
    "deepseek3_llm": ((
        "\\p{N}{1,3}",
        "[一-龥぀-ゟ゠-ヿ]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ), True),
    "spark2_5": ((
        "\\p{N}{1,3}",
        "[一-龥぀-ゟ゠-ヿ]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+",
        "\\p{N}",
    ), True),
    "youtu": ((
        "[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ), True),
    "deepseek_coder": ((
        "[\r\n]",
        "\\s?\\p{L}+",
        "\\s?\\p{P}+",
        "[一-龥ࠀ-一가-퟿]+",
        "\\p{N}",
    ), True),
    "falcon": ((
        "[\\p{P}\\$\\+<=>\\^~\\|`]+",
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
        "[0-9][0-9][0-9]",
    ), True),
    "starcoder": ((
        "\\p{N}",
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    ), True),
    "gpt2": ((
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    ), True),
    "stablelm2": ((
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ), True),
    "qwen35": ((
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ), True),
    "poro": ((
        " ?[^(\\s|.,!?…。，、।۔،)]+",
    ), True),
    "chatglm4": ((
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ), True),
    "viking": ((
        " ?[^(\\s|.,!?…。，、।۔،)]+",
        "\\p{N}",
    ), True),
    "tekken": ((
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ), True),
    "chameleon": ((
        "<sentinel:[0-9]+>",
        "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        "([\\t\\n]|    |  )",
        "\\p{N}",
        "[\\p{P}!-/:-@\\[-`{-~]",
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    ), True),
    "gpt4o": ((
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ), True),
    "granite_emb_multi": ((
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ), True),
    "superbpe": ((
        "\\p{N}+",
        "(?=(\\d{3})+(?!\\d))",
    ), True),
    "bailingmoe": ((
        "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
    ), True),
    "seed_coder": ((
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ), True),
    "ufakzeka": ((
        "[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ), True),
    "grok_2": ((
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ), True),
    "laguna": ((
        "[^\\n]+|[\\n]+",
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ), True),
    "exaone_moe": ((
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
    ), True),
    "gemma4": ((
        "[^\\n]+|[\\n]+",
    ), False),
    "sarvam_moe": ((
        "[^\\n]+|[\\n]+",
    ), False),
    "minicpm5": ((
        "\\p{N}{1,3}",
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ), True),
    "default": ((
        "[\\p{P}\\$\\+<=>\\^~\\|]+",
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
        "\\p{N}+",
        "[0-9][0-9][0-9]",
    ), True),
}
for _alias, _same in {"smaug": "dbrx", "hunyuan_dense": "deepseek3_llm", "joyai_llm": "deepseek3_llm", "hy_v4": "deepseek3_llm", "refact": "starcoder", "command_r": "starcoder", "smollm": "starcoder", "codeshell": "starcoder", "exaone": "starcoder", "minerva": "starcoder", "mellum2": "starcoder", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2", "trillion": "gpt2", "granite_docling": "gpt2", "qwen2": "stablelm2", "hunyuan": "stablelm2", "solar_open": "stablelm2", "bloom": "poro", "gpt3_finnish": "poro", "minimax_m2": "gpt4o"}.items():
    REGEXES[_alias] = REGEXES[_same]

# tokenizer.ggml.pre -> (type, flags llama.cpp sets for it); a missing `pre` means "default"
PRE_NAMES: dict[str, tuple[str, dict]] = {
    "default": ("default", {}),
    "minicpm5": ("minicpm5", {'ignore_merges': True}),
    "llama3": ("llama3", {'ignore_merges': True, 'add_bos': True}),
    "llama-v3": ("llama3", {'ignore_merges': True, 'add_bos': True}),
    "llama-bpe": ("llama3", {'ignore_merges': True, 'add_bos': True}),
    "falcon3": ("llama3", {'ignore_merges': True, 'add_bos': True}),
    "falcon-h1": ("llama3", {'ignore_merges': True, 'add_bos': True}),
    "pixtral": ("llama3", {'ignore_merges': True, 'add_bos': True}),
    "midm-2.0": ("llama3", {'ignore_merges': True, 'add_bos': True}),
    "lfm2": ("llama3", {'ignore_merges': True, 'add_bos': True}),
    "jina-v5-nano": ("llama3", {'ignore_merges': True, 'add_bos': True}),
    "deepseek-llm": ("deepseek_llm", {}),
    "deepseek-coder": ("deepseek_coder", {}),
    "deepseek-v3": ("deepseek3_llm", {}),
    "spark2_5": ("spark2_5", {}),
    "youtu": ("youtu", {'ignore_merges': True}),
    "falcon": ("falcon", {}),
    "mpt": ("mpt", {}),
    "starcoder": ("starcoder", {}),
    "gpt-2": ("gpt2", {}),
    "phi-2": ("gpt2", {}),
    "jina-es": ("gpt2", {}),
    "jina-de": ("gpt2", {}),
    "gigachat": ("gpt2", {}),
    "jina-v2-es": ("gpt2", {}),
    "jina-v2-de": ("gpt2", {}),
    "a.x-4.0": ("gpt2", {}),
    "mellum": ("gpt2", {}),
    "modern-bert": ("gpt2", {}),
    "jais-2": ("jais2", {}),
    "gemma4": ("gemma4", {'escape_whitespaces': True}),
    "granite-embed-multi-311m": ("gemma4", {'escape_whitespaces': True}),
    "sarvam-moe": ("sarvam_moe", {'escape_whitespaces': True}),
    "jina-v1-en": ("gpt2", {}),
    "jina-v2-code": ("gpt2", {}),
    "roberta-bpe": ("gpt2", {}),
    "refact": ("refact", {}),
    "command-r": ("command_r", {}),
    "qwen2": ("qwen2", {}),
    "deepseek-r1-qwen": ("qwen2", {}),
    "kormo": ("qwen2", {}),
    "f2llmv2": ("qwen2", {}),
    "qwen35": ("qwen35", {}),
    "stablelm2": ("stablelm2", {}),
    "olmo": ("olmo", {}),
    "dbrx": ("dbrx", {}),
    "smaug-bpe": ("smaug", {}),
    "poro-chat": ("poro", {}),
    "chatglm-bpe": ("chatglm4", {'no_bos': True}),
    "glm4": ("chatglm4", {'no_bos': True, 'ignore_merges': True}),
    "glm5": ("chatglm4", {'no_bos': True, 'ignore_merges': True}),
    "viking": ("viking", {}),
    "jais": ("jais", {}),
    "tekken": ("tekken", {'ignore_merges': True, 'add_bos': True}),
    "smollm": ("smollm", {}),
    "codeshell": ("codeshell", {}),
    "bloom": ("bloom", {}),
    "gpt3-finnish": ("gpt3_finnish", {}),
    "exaone": ("exaone", {}),
    "exaone4": ("gpt2", {}),
    "exaone-moe": ("exaone_moe", {}),
    "chameleon": ("chameleon", {'add_bos': True}),
    "minerva-7b": ("minerva", {}),
    "megrez": ("qwen2", {}),
    "gpt-4o": ("gpt4o", {}),
    "llama4": ("gpt4o", {}),
    "kanana2": ("gpt4o", {}),
    "talkie": ("gpt4o", {}),
    "granite-embed-multi-97m": ("granite_emb_multi", {'ignore_merges': True}),
    "superbpe": ("superbpe", {}),
    "trillion": ("trillion", {}),
    "granite-docling": ("granite_docling", {}),
    "bailingmoe": ("bailingmoe", {}),
    "bailingmoe2": ("bailingmoe", {}),
    "llada-moe": ("bailingmoe", {}),
    "seed-coder": ("seed_coder", {}),
    "hunyuan": ("hunyuan", {}),
    "hunyuan-dense": ("hunyuan_dense", {}),
    "hy_v4": ("hy_v4", {}),
    "joyai-llm": ("joyai_llm", {}),
    "ufakzeka": ("ufakzeka", {}),
    "grok-2": ("grok_2", {}),
    "laguna": ("laguna", {}),
    "minimax-m2": ("minimax_m2", {}),
    "solar-open": ("solar_open", {}),
    "mellum2": ("mellum2", {}),
}
