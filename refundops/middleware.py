"""The site's middleware that the agent API passes by.

A request to ``/api/`` is authenticated by its key alone (refundops.api.auth; DRF's
SessionAuthentication is not configured, DRF exempts its views from Django's CSRF check, and DRF
sets the request's user to its own, None, once the key is read), so it has no use for a session,
the signed-in user and their second factor, messages, or simple_history's request, and a session
cookie sent along grants it nothing either way. These classes are Django's, django-otp's and
simple_history's for every other request (the admin and its sign-in keep the whole chain) and
hand an API request straight on. Whatever protects or labels an answer runs for every request:
security headers, CSRF, X-Frame-Options, WhiteNoise, CommonMiddleware, django-axes, our request
id and metrics. Subclasses, not wrappers, so Django's admin checks still find the classes it needs.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction
from django.contrib.auth import middleware as auth
from django.contrib.messages import middleware as messages
from django.contrib.sessions import middleware as sessions
from django.utils.decorators import sync_and_async_middleware
from django_otp import middleware as otp
from simple_history import middleware as history

API_PREFIX = "/api/"


def is_api(request) -> bool:
    return request.path_info.startswith(API_PREFIX)


class _ApiPassesBy:
    def __call__(self, request):
        if is_api(request):
            return self.get_response(request)  # a coroutine under ASGI, awaited by the caller
        return super().__call__(request)


class SessionMiddleware(_ApiPassesBy, sessions.SessionMiddleware):
    pass


class AuthenticationMiddleware(_ApiPassesBy, auth.AuthenticationMiddleware):
    pass


class OTPMiddleware(_ApiPassesBy, otp.OTPMiddleware):
    pass


class MessageMiddleware(_ApiPassesBy, messages.MessageMiddleware):
    pass


@sync_and_async_middleware
def HistoryRequestMiddleware(get_response):
    site = history.HistoryRequestMiddleware(get_response)
    if iscoroutinefunction(get_response):
        async def middleware(request):
            return await (get_response if is_api(request) else site)(request)
    else:
        def middleware(request):
            return (get_response if is_api(request) else site)(request)
    return middleware
