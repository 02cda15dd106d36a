"""The cache: the facade an engine talks to (`UnifiedRadixCache`), the one request
state (`RequestState`), where handles change hands (`Ledger`: alloc-with-evict and the
only place they are freed), and the audit every test runs (`audit`)."""
from .audit import AuditError, audit
from .cache import UnifiedRadixCache
from .handles import CacheFull, Ledger
from .request import RequestState

__all__ = ["UnifiedRadixCache", "RequestState", "CacheFull", "Ledger", "audit", "AuditError"]
