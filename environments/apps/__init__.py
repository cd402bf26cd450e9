"""Mock apps (HTTP API + SQLite) inside the sandbox: the server, the in-sandbox client and the env base they share."""
