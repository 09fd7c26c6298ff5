"""Layout planning: the playbook's "find the best training configuration" as a tool
(`python -m jscale.plan`)."""
