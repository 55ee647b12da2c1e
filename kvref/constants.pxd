# The C-level view of kvref/constants.py for the Cython twins (tests/test_constants.py checks they agree).
cdef enum:
    LLAMA_MAX_SEQ = 256
    N_SEQ_WORDS = 4
