"""Kubernetes: the one pure injection function (:mod:`.inject`) shared by ``shardcache inject``
and the mutating admission webhook (:mod:`.webhook`)."""

from sidecar.k8s.inject import InjectConfig, InjectionError, inject, inject_documents

__all__ = ["InjectConfig", "InjectionError", "inject", "inject_documents"]
