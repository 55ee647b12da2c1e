"""kvref.store: llama.cpp prompt prefixes kept once, served token-exactly (being built; see backend.py)."""
