"""Recipes: a whole pipeline (prepare a target, prompts, collect, train, export) as configs run by one driver."""
