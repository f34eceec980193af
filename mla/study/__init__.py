"""The study, the package's top floor below the CLI: experiments -> variants -> jobs (`experiments`), the
config's schema (`config_schema`) and its parse-time checks (`layout_check`, `memory_check`, `kv_check`, on
the models' configs from `model_configs`), the validated config as the file the verbs read (`config_file`),
a workflow `train` block as `mla train` options (`train_options`), data and time budgets (`budgets`), what
each checkpoint's two evaluation jobs measure (`evaluation_jobs`), and what the study produces: the figure and
tables as specs (`reports`), drawn by `figures` and `tables`, with the paper's numbers beside ours
(`paper_numbers`). The stages below never import it (docs/package.md, checked by import-linter)."""
