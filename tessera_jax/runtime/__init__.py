"""The runtime: public entry points, the static table of backends, and the dense route."""
