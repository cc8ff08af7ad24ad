"""Kubernetes: the one pure injection function (:mod:`.inject`) shared by ``shardcache inject``
and the mutating admission webhook (:mod:`.webhook`), the JSON patch the webhook answers with
(:mod:`.patch`), the hardened multi-document YAML of the CLI (:mod:`.yamldocs`) and the Pod
Security check (:mod:`.podsecurity`)."""

from sidecar.k8s.inject import InjectConfig, InjectionError, inject, inject_documents

__all__ = ["InjectConfig", "InjectionError", "inject", "inject_documents"]
