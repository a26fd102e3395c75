"""Drivers the engine tests run inside the engines' own virtual environments (`make
test-engines` builds them): each reads a JSON spec, runs the real engine, prints JSON."""
