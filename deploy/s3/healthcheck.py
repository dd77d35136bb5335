"""The S3 server's health check: its S3 port answers HTTP (anonymous requests get 403)."""

import sys
import urllib.error
import urllib.request

try:
    urllib.request.urlopen("http://127.0.0.1:8333/", timeout=2)
except urllib.error.HTTPError:
    pass  # an answer: the server is up (it refuses anonymous listing)
except OSError as exc:
    sys.exit(f"S3 server not answering: {exc}")
