"""symbiosis-tinker: a Tinker-compatible training and sampling service (docs/tinker.md)"""
