"""Configuration: the topology and its field types, the Kafka client and reward blocks, the estimator table, redaction."""
