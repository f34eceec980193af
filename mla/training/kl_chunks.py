"""How the distillation KL walks the logits (mla/training/distill.py): tokens in chunks of at most
KL_CHUNK_ELEMENTS logits, in fp32. Torch-free, so that the memory plan (mla/training/memory.py) can count it."""

KL_CHUNK_ELEMENTS = 2**22      # logits per chunk (tokens x vocabulary): 16 MB per fp32 temporary
KL_CHUNK_TEMPORARIES = 6       # fp32 chunk-sized tensors alive at once (both softmaxes, their logs, products)


def chunk_rows(vocab: int, chunk_elements: int = KL_CHUNK_ELEMENTS) -> int:
    """Tokens per chunk of the KL: as many as fit `chunk_elements` logits (at least one)."""
    return max(1, chunk_elements // vocab)
