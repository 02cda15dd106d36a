"""uniradix: a prefix cache for hybrid LLMs."""


def installed_version() -> str:
    """The installed package's version (`uniradix --version`, the server's /version):
    "unknown" where it runs from a source tree that was never installed."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("uniradix")
    except PackageNotFoundError:
        return "unknown"
