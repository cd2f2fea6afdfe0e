"""Recipes shipped with dlaunch: one readable .py plus its YAML each."""
