"""Operations: what an on-call engineer runs (``sqla-outbox status|runs|dlq|purge``)."""
