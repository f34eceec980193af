"""Choices and defaults that the CLI, the conversion, the study and the workflow schema share, defined once
here (torch-free, so the Snakefile and `mla --help` import it cheaply). The schema's lists are filled from
these by mla.study.config_schema; the recipe's defaults live in mla.training.config.TrainConfig."""

ROPE_STRATEGIES = ("high", "low", "uniform", "2-norm", "rotated", "ladder")
DEFAULT_ROPE_STRATEGY = "2-norm"       # the paper's S_2-norm (needs `mla calibrate` scores)
# rotated: RoPE kept on the best components of each frequency pair rotated across the K/V heads, as ONE
# RoPE key shared by all query heads (mla/conversion/rotation.py); the others keep it per KV head.
# ladder: rotated with at most one component per frequency, on the frequencies DeepSeek's 64-dim RoPE key can
# hold (mla/conversion/ladder.py): the layout `mla export --format deepseek_v3` needs
LADDER_ROPE_STRATEGY = "ladder"
SHARED_ROPE_STRATEGIES = ("rotated", LADDER_ROPE_STRATEGY)
CALIBRATED_ROPE_STRATEGIES = ("2-norm", "rotated", LADDER_ROPE_STRATEGY)   # read the scores file of `mla calibrate`
LATENT_LAYOUTS = ("per_head", "shared")   # shared: k_up/v_up rebuild a key and value for every query head
DEFAULT_LATENT = "per_head"               # the paper's: one key and value per KV head
SVD_METHODS = ("joint", "split", "none")   # none: partial RoPE only, K/V kept at full rank
DEFAULT_SVD = "joint"                      # the paper's SVD_joint
MODEL_SOURCES = ("smollm2-wheel", "hub", "local", "mha-from-gqa", "tiny-random")
DEFAULT_VALIDATION_FRACTION = 0.12         # share of documents held out, by document hash: `mla data` splits
                                           # by it and the local lm-eval task must pick the same files; 0.12
                                           # leaves pydoc-stdlib's held-out docstrings 1.8x what 65,536 needs
DEFAULT_VALIDATION_TOKENS = 65536          # held-out tokens per data folder (`mla data`, data.validation_tokens)
# Layer-wise fitting (`mla fit`, a variant's `fit:`): steps and learning rate per layer, training blocks
# read, blocks per step, validation blocks for the held-out errors and loss (mla/conversion/fit.py)
FIT_DEFAULTS = {"steps": 100, "lr": 1.0e-3, "blocks": 64, "batch": 8, "heldout": 64, "span": 1, "echo": 0,
                "schedule": "constant"}
FIT_SCHEDULES = ("constant", "cosine")     # the learning rate over a layer's steps (mla.conversion.fit.fit_lr)
