"""Text to tokens and back: the GGUF's tokenizer and llama.cpp's vocabulary rules."""
