"""Everything weights come from and go to: training checkpoints (`checkpoint`), params-only
checkpoints (`params_io`), starting a run from pretrained weights (`init_from`) and a trained
model for generation, evaluation and export (`model_source`). The Hugging Face bridge is
`jscale.convert`. Nothing here loads a config file: saved configs become a `Config` through
`jscale.config_dict`."""
