"""The worker side: builds the strategy, runs the recipe's step, logs and writes results."""
