"""The miss path: single flight, fetch leases, downloads and what clients read of them."""
