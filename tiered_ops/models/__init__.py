"""Models: ``patch`` puts the ops into a model's modules, ``tune`` measures the calls of one real step."""
