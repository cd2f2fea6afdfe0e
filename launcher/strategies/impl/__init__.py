"""The torch side of each strategy (``launcher/strategies/NAME.py`` is its unit): imported when a worker builds one."""
