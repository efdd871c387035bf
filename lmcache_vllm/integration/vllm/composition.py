"""`LMCacheConnector` beside other connectors (docs/COMPOSING.md): its name in vLLM's `KVConnectorFactory`, and
what it does as one child of vLLM's `MultiConnector`.

- `register_connector()` makes `KVConnectorFactory.get_connector_class_by_name("LMCacheConnector")` answer in
  this process: MultiConnector rebuilds its children's stats in the API server by class name, and a child
  loaded only through `kv_connector_module_path` is "not registered" there. connector.py calls it when it is
  imported, which vLLM does in every process that builds the connector or its metrics. Idempotent, and lazy
  like vLLM's own entries (a module path, imported on the first lookup).
- `Composition`: the MultiConnector this connector is a child of, as far as the child needs it: the other
  children's connector names and the MultiConnector's own `kv_load_failure_policy`. MultiConnector hands each
  child a copy of the VllmConfig whose kv_transfer_config is the child's own entry, so the parent's settings
  are visible only on the MultiConnector being built, which is on the call stack while it constructs its
  children (`find_composition`).
- `pd_enabled(mode)`: `extra_config.pd` — on, off, or auto: off when another child does the handoff.
- `namespaced_params`: our prefill params go under our own key only, unless every other child is known never
  to return kv_transfer_params (MultiConnector raises on any key two children share).
- `load_policy_warning()`: vLLM applies the MultiConnector's `kv_load_failure_policy`; ours cannot change it.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any, Mapping, Sequence

CONNECTOR_NAME = "LMCacheConnector"
CONNECTOR_MODULE = "lmcache_vllm.integration.vllm.connector"
_MULTI_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"
_MAX_FRAMES = 30  # MultiConnector.__init__ is a few frames above a child's __init__

# Connectors that move a request's KV from a prefill to a decode instance through kv_transfer_params
# (vLLM 0.32 / 0.33 factory names; P2pNcclConnector: earlier releases).
PD_CONNECTORS = frozenset({"NixlConnector", "NixlPullConnector", "NixlPushConnector", "MooncakeConnector",
                           "MoRIIOConnector", "P2pNcclConnector"})
# Connectors whose request_finished never returns kv_transfer_params (vLLM 0.32: the base class's answer).
QUIET_CONNECTORS = frozenset({"ExampleConnector", "DecodeBenchConnector"})

logger = logging.getLogger(__name__)


def register_connector() -> bool:
    """Registers `LMCacheConnector` with vLLM's factory by name; True when this call registered it."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # vLLM's answer to a name registered before: by an earlier import, or a plugin
        return False
    return True


@dataclass(frozen=True)
class Composition:
    """Where this connector runs: alone (`in_multi` False) or as one child of a MultiConnector."""

    in_multi: bool = False
    siblings: tuple[str, ...] = ()  # the other children's kv_connector names, in the MultiConnector's order
    parent_policy: str | None = None  # the MultiConnector's kv_load_failure_policy

    @classmethod
    def of_children(cls, children: Sequence[Mapping[str, Any]], index: int,
                    parent_policy: str | None) -> "Composition":
        """The composition of child `index` of a MultiConnector's `connectors` list."""
        siblings = tuple(str(c.get("kv_connector") or "") for i, c in enumerate(children) if i != index)
        return cls(in_multi=True, siblings=siblings, parent_policy=parent_policy)

    @property
    def pd_siblings(self) -> tuple[str, ...]:
        return tuple(s for s in self.siblings if s in PD_CONNECTORS)

    def pd_enabled(self, mode: str) -> bool:
        """`extra_config.pd`: 'on', 'off', or 'auto' (on unless another child handles disaggregation)."""
        if mode == "on":
            return True
        if mode == "off":
            return False
        return not self.pd_siblings

    @property
    def namespaced_params(self) -> bool:
        """Our prefill params only under our own key: another child may return kv_transfer_params too."""
        return self.in_multi and not all(s in QUIET_CONNECTORS for s in self.siblings)

    def describe_pd(self, mode: str) -> str:
        """One start-up line on our part in disaggregated prefill."""
        on = self.pd_enabled(mode)
        why = (f"extra_config.pd={mode}" if mode != "auto" else
               f"auto: {', '.join(self.pd_siblings)} beside it does the handoff" if not on else "auto")
        params = " (its kv_transfer_params under the key 'lmcache_vllm' only)" if on and self.namespaced_params else ""
        return f"disaggregated prefill {'on' if on else 'off'} ({why}){params}"

    def load_policy_warning(self) -> str | None:
        """The warning for a MultiConnector whose policy fails requests on a failed load (None: nothing to say)."""
        if not self.in_multi or self.parent_policy != "fail":
            return None
        return ("LMCacheConnector runs inside a MultiConnector whose kv_load_failure_policy is 'fail': a chunk it "
                "cannot load (evicted, corrupt, a tier timing out) then fails the request instead of being "
                "recomputed. Set \"kv_load_failure_policy\": \"recompute\" at the top level of the MultiConnector's "
                "--kv-transfer-config: vLLM reads the policy there, and the child's own setting (which "
                "LMCacheConnector sets to 'recompute') is a copy vLLM never reads")


def find_composition(own_vllm_config: object) -> Composition:
    """The composition of the connector being built with `own_vllm_config`: a child of the MultiConnector whose
    __init__ is on the call stack, or alone."""
    multi = sys.modules.get(_MULTI_MODULE)
    if multi is None:  # vLLM never imported MultiConnector in this process: it is not building us
        return Composition()
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "__init__" and isinstance(owner, multi.MultiConnector):
            # Children are built in order and appended once built: ours is the next index. Its VllmConfig copy
            # is a local of that frame, which tells a child apart from another connector built meanwhile.
            if not any(v is own_vllm_config for v in frame.f_locals.values()):
                break
            parent = owner._kv_transfer_config
            children = list((parent.kv_connector_extra_config or {}).get("connectors") or [])
            index = len(getattr(owner, "_connectors", ()))
            if not 0 <= index < len(children):
                break
            return Composition.of_children(children, index, parent.kv_load_failure_policy)
        frame = frame.f_back
    return Composition()
