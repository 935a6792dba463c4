"""Payment gateways behind one interface.

The ground floor: nothing here imports from ``refundops`` or ``approvals``. Adapters take and
return the frozen dataclasses in :mod:`processors.base`, so a gateway knows nothing of our models.
"""
