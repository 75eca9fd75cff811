"""fabric-apps: applications built only on the public fabric contract (``fabric_core``).

``fabric_apps.kvcache``: disaggregated prefill→decode KV-cache transfer.
``fabric_apps.moe``: expert-parallel MoE dispatch and combine over one-sided writes.
``fabric_apps.weights``: RL weight updates from training ranks straight into inference ranks'
memory (a static transfer plan, staged casts, per-source counters).
"""

from __future__ import annotations

import logging

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__: list[str] = []
