"""REST authentication: ``Authorization: Bearer rk_…``, then the view's capability."""

from __future__ import annotations

from rest_framework import authentication, permissions

from refundops.access import authenticate_key, require_capability


class AgentKeyAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        scheme, _, raw = header.partition(" ")
        key = authenticate_key(raw.strip() if scheme.lower() == "bearer" else None)
        return (None, key)

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="refundops"'


class HasCapability(permissions.BasePermission):
    """The view names its capability (``required_capability``); the key's agent must hold it."""

    def has_permission(self, request, view) -> bool:
        require_capability(request.auth, view.required_capability)
        return True
