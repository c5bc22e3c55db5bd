"""Text: tokenizers (GGUF vocabularies as llama.cpp reads them, tokenizer.json), chat templates,
and the tool-call and reasoning formats of chat models. Torch-free; depends only on errors."""
