"""specray.native: the only code that touches llama.cpp (through llama_cpp)."""
