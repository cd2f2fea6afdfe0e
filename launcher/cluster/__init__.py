"""Cluster description: shapes, the worker's environment, process groups, resolvers."""
