"""Kafka plumbing: client factories, topics, dead-letter headers, record provenance."""
