"""Language models: loading (packaged offline defaults, hub ids, paths), SFT, and generation backends."""
