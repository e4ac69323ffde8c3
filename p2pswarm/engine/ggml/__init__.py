"""libggml (llama.cpp's tensor library, through ctypes): loading it, running graphs, the dense path's quantised mat-muls, the attention graphs' shared pieces."""
