"""The edge layer: the HTTP server around the protocols (the app, middleware, auth, cross-site checks, access
log, slow clients, error handlers, the docs pages) and Ray Serve's replica, which wraps the app."""
