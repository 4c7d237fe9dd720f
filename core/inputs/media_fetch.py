"""Downloading an image URL, only from the hosts the operator allowed.

Off by default: with no ``allowed_media_domains`` every ``http(s)`` URL is refused and nothing is
downloaded. vLLM fetches any URL unless ``--allowed-media-domains`` narrows it; poolrunner takes
the same flag as the explicit list that turns fetching on. A host matches exactly (``a.example``
does not allow ``b.a.example``), as vLLM compares them. The download is bounded: a timeout for
connecting, for each read and for the whole body (vLLM's ``VLLM_IMAGE_FETCH_TIMEOUT``, 5 s), the byte limit enforced
while the body streams in (a lying or missing ``Content-Length`` cannot get more through), and
redirects followed only to allowed hosts (at most :data:`MAX_REDIRECTS`). It runs where the
image is preprocessed (the model's preprocessing threads, ``ImageInputs.pixels_of``), never on
the server's event loop.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urljoin, urlsplit

from poolrunner.core.errors import InvalidRequestError

MAX_REDIRECTS = 5


def fetch(url: str, limits: Any, name: str) -> bytes:
    """The body of ``url``, at most ``limits.max_bytes`` bytes.

    :param limits: An :class:`~poolrunner.core.inputs.images.ImageLimits` (its
        ``allowed_media_domains``, ``max_bytes`` and ``fetch_timeout``).
    :param name: How errors name the input (``input 2``).
    :raises InvalidRequestError: naming ``name`` and the URL: a host not allowed (or none
        allowed), a failed connection, a timeout, a status other than 200, too many redirects,
        or a body over the limit.
    """
    import httpx

    shown = url[:80]
    with httpx.Client(timeout=limits.fetch_timeout, follow_redirects=False, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            _check_host(url, limits.allowed_media_domains, name)
            try:
                with client.stream("GET", url) as response:
                    if response.is_redirect and "location" in response.headers:
                        url = urljoin(url, response.headers["location"])
                        continue
                    if response.status_code != 200:
                        raise InvalidRequestError(f"{name}: fetching {shown!r} answered HTTP {response.status_code}")
                    return _bounded_body(response, limits, name, shown, time.monotonic() + limits.fetch_timeout)
            except httpx.TimeoutException:
                raise InvalidRequestError(f"{name}: fetching {shown!r} took longer than the "
                                          f"{limits.fetch_timeout:g} s timeout") from None
            except httpx.HTTPError as exc:
                raise InvalidRequestError(f"{name}: cannot fetch {shown!r}: {type(exc).__name__}") from None
    raise InvalidRequestError(f"{name}: fetching {shown!r} redirected more than {MAX_REDIRECTS} times")


def _check_host(url: str, allowed: tuple[str, ...], name: str) -> None:
    """:raises InvalidRequestError: unless ``url``'s host is one of ``allowed``."""
    if not allowed:
        raise InvalidRequestError(f"{name}: remote image URLs are refused ({url[:60]!r}); poolrunner downloads "
                                  "nothing unless the operator allows the host (--allowed-media-domains): pass "
                                  "the image's bytes or a data: URL")
    host = (urlsplit(url).hostname or "").lower()
    if urlsplit(url).scheme not in ("http", "https") or host not in allowed:
        raise InvalidRequestError(f"{name}: the image URL's host {host!r} is not among the allowed media domains "
                                  f"({', '.join(allowed)})")


def _bounded_body(response: Any, limits: Any, name: str, shown: str, deadline: float) -> bytes:
    """The streamed body, refused as soon as it passes ``limits.max_bytes`` (nothing more is
    read) or the ``deadline`` (a body trickling in never holds a thread longer than the timeout)."""
    max_bytes = limits.max_bytes
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise InvalidRequestError(f"{name}: {shown!r} has {declared} bytes, more than the limit of {max_bytes}")
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > max_bytes:
            raise InvalidRequestError(f"{name}: {shown!r} sent more than the limit of {max_bytes} bytes")
        if time.monotonic() > deadline:
            raise InvalidRequestError(f"{name}: fetching {shown!r} took longer than the "
                                      f"{limits.fetch_timeout:g} s timeout")
    return bytes(body)
