"""The study: experiments -> variants -> jobs (`experiments`), the config's schema and shared choices
(`config_schema`, `options`), data budgets (`budgets`), MLflow conventions (`tracking`), and what the
study produces: figures, tables and the paper's numbers beside ours."""
