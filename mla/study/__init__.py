"""The study: experiments -> variants -> jobs (`experiments`), the config's schema and shared choices
(`config_schema`, `options`), the validated config as the file the verbs read (`config_file`), data
budgets (`budgets`), what each checkpoint's two evaluation jobs measure (`evaluation_jobs`), MLflow
conventions (`tracking`), and what the study produces: the figure and tables as specs (`reports`),
drawn by `figures` and `tables`, with the paper's numbers beside ours (`paper_numbers`)."""
