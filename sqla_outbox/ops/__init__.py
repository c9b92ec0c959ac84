"""Operations: what an on-call engineer runs (``python -m sqla_outbox status|runs|dlq|purge``)."""
