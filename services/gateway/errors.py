"""Domain errors of the gateway. Each transport maps them to its status codes in one table:
server.py (gRPC) and http.py (HTTP). Messages are for the client: they say what is wrong."""

from __future__ import annotations


class GatewayError(Exception):
    """Base of the errors a client sees."""


class InvalidRequest(GatewayError):
    """Bad input: malformed values, unknown model, too long a prompt. (INVALID_ARGUMENT, 400)"""


class UnknownSession(GatewayError):
    """A request names a session the gateway holds no history for. (NOT_FOUND, 404)"""


class NoVerifierAvailable(GatewayError):
    """No live verifier serves the model, or none could be reached. (UNAVAILABLE, 503)"""


class Overloaded(GatewayError):
    """Too many requests in flight, or every verifier's KV cache is full. (RESOURCE_EXHAUSTED, 429)"""


class DeadlineExceeded(GatewayError):
    """The request's deadline passed before generation finished. (DEADLINE_EXCEEDED, 504)"""


class UpstreamFailed(GatewayError):
    """A verifier failed after the request started streaming (cut stream, reported error, broken
    protocol). Tokens already streamed stand; the rest never came. (ABORTED, 502)"""


# Raised by client.py before anything streamed, and handled by the core (next candidate); never
# seen by clients.


class VerifierUnreachable(Exception):
    """The verifier did not answer (connection refused, channel down)."""


class VerifierBusy(Exception):
    """The verifier refused the session for lack of KV cache (RESOURCE_EXHAUSTED)."""
