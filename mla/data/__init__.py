"""Training data: text sources -> tokenized, packed token blocks on disk, with a manifest.

A *corpus* is a list of weighted *sources*, each a stream of documents ``(key, text)``
(`mla.data.corpus`, `mla.data.readers`). `build_dataset` reads every source once, assigns each
document to the ``validation`` split by a hash of (source, key) (`in_validation`: disjoint by document,
independent of budgets, seeds and workers), tokenizes in worker processes (`mla.data.tokenize`),
appends the tokenizer's EOS to each document (EOS stays in the loss), interleaves the sources so that
each split's tokens follow the weights exactly (`mla.data.mix`), and appends the tokens to one file
per split (`mla.data.writer`) until the split's budget is met: ``budget // block_length`` blocks. There is
no global shuffle; training permutes the blocks every epoch. Memory stays flat in the corpus size;
the output appears only when complete, and an interrupted build resumes (`mla.data.build`).

Output folder (`mla.data.manifest`)::

    OUT/train.bin, OUT/validation.bin            token ids [n_blocks * block_length] (uint16/uint32, little-endian)
    OUT/documents-train.tsv, ...-validation.tsv  source, key, offset, tokens (one row per document)
    OUT/manifest.json                            request, tokens/documents/shares per source, sha256 per file

Read it with `open_blocks(dir, split)` (a read-only memory map [n_blocks, block_length]; `load_blocks` also
takes a .npy file; `join_consecutive` makes longer sequences of consecutive blocks) and
`read_manifest(dir)`. Named corpora: ``pydoc-stdlib`` (offline default, from what every Python installs:
the standard library's docstrings and pydoc's topics, 0.7, and its sources, 0.3), ``debian-docs-stdlib``
(the documentation's reStructuredText from Debian's python3.11-doc instead of the docstrings) and
``smollm`` (the paper's Hub mixture, streamed with ``datasets``; `MLA_HUB_DATASETS_MIRROR` and
`MLA_SWH_CONTENT_URL` swap its locations, see `mla.data.mirror`). A YAML/JSON file with a ``sources``
list defines others (see `load_corpus`).
"""

from mla.data.build import DEFAULT_VALIDATION_TOKENS, build_dataset
from mla.data.corpus import (CORPORA, DEBIAN_DOCS_STDLIB, DEFAULT_CORPUS, PYDOC_STDLIB, SMOLLM_MIXTURE, SPLITS,
                             Source, in_validation, load_corpus)
from mla.data.manifest import MANIFEST, join_consecutive, load_blocks, open_blocks, read_manifest
from mla.data.readers import READERS, stdlib_files

__all__ = ["CORPORA", "DEBIAN_DOCS_STDLIB", "DEFAULT_CORPUS", "DEFAULT_VALIDATION_TOKENS", "MANIFEST", "PYDOC_STDLIB", "READERS",
           "SMOLLM_MIXTURE", "SPLITS", "Source", "build_dataset", "in_validation",
           "join_consecutive", "load_blocks", "load_corpus", "open_blocks", "read_manifest", "stdlib_files"]
