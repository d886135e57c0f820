"""The daemon's I/O side: durable state now; links, local API and CLI as they land."""
