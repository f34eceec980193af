"""lm-eval task definitions of our own (YAML + Python), registered with TaskManager(include_path=...)."""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
LOCAL_TASK = "mla_stdlib_next_line"
MMLU_TASK = "mla_mmlu_cloze"
