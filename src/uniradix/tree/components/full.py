"""FULL attention: KV for every page of the prefix; it shapes the tree."""
from ..component import PageComponent


class FullComponent(PageComponent):
    name = "full"
    structural = True

    def __init__(self) -> None:
        super().__init__(window=None)
