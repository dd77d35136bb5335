"""The HTTP side: the ASGI app, the process runner, our HTTP protocol, serving bytes."""
