"""The default strategy: what ``get_strategy()`` returns when no strategy is in scope.

One replica, no placement, no communication: the same API with the obvious meaning.
"""

from __future__ import annotations

from launcher.distribute.extended import StrategyExtended
from launcher.distribute.strategy import Strategy


class DefaultStrategy(Strategy):
    _is_user_strategy = False

    def __init__(self) -> None:
        super().__init__(StrategyExtended(["cpu:0"]))
