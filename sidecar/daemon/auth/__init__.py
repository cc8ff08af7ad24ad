"""``shardcache serve --auth sigv4``: a node cache many tenants share, where none reads another's
data. The sidecar proves (:mod:`.prover`), the daemon checks with the origin (:mod:`.authorizer`),
over the wire format of :mod:`.proofs`, signed by :mod:`.sigv4`."""

from sidecar.daemon.auth.authorizer import IDENTITIES, Authorizer, AuthSettings, Session, tenant_of
from sidecar.daemon.auth.proofs import RENEW_HEADER, InvalidProof, Proof, ProofBatch, Target
from sidecar.daemon.auth.prover import Prover

__all__ = [
    "IDENTITIES", "AuthSettings", "Authorizer", "InvalidProof", "Proof", "ProofBatch", "Prover", "RENEW_HEADER",
    "Session", "Target", "tenant_of",
]
