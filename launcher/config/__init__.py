"""The one validated run spec: pydantic models, Hydra composition, readable errors."""
