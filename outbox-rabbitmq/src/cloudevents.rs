//! The names of the CloudEvents attribute headers on RabbitMQ. AMQP 0-9-1 has header
//! tables, not AMQP 1.0 application properties; the SDKs that read CloudEvents from
//! RabbitMQ read these names (each checked in its source, see [docs/rabbitmq.md](https://github.com/outbox-rs/outbox/blob/main/docs/rabbitmq.md)):
//!
//! | prefix | read by |
//! | --- | --- |
//! | `cloudEvents:` (default) | the AMQP binding 1.0.2 (section 3.1.3.1); Go `sdk-go` `protocol/amqp` (only this one), Java `cloudevents-amqp-proton` (only this one), Java `cloudevents-spring` AMQP, C# `CloudNative.CloudEvents.Amqp`, Python `cloudevents.core.bindings.amqp` |
//! | `cloudEvents_` | what outbox 0.1 wrote; the binding's working draft prefers it (JMS); Java `cloudevents-spring` AMQP, C#, Python `cloudevents.core.bindings.amqp`; not Go, not Java proton |
//! | `ce-` | Knative's RabbitMQ binding (eventing-rabbitmq); Python `cloudevents.core.bindings.rabbitmq` (only this one) |
//!
//! The consumer ([`RabbitTransport`](crate::RabbitTransport)) reads all three.

/// Which prefix the publisher gives the CloudEvents attribute headers
/// ([`RabbitPublisherBuilder::cloudevents_headers`](crate::RabbitPublisherBuilder::cloudevents_headers)).
/// See the [module docs](self) for who reads which.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum CloudEventsHeaders {
    /// `cloudEvents:id`, ...: the AMQP binding 1.0.2's names, read by every AMQP SDK
    /// (Go, Java, C#, Python). The default.
    #[default]
    AmqpBinding,
    /// `cloudEvents_id`, ...: what outbox 0.1 wrote; not read by Go's `sdk-go` nor
    /// Java's proton binding.
    Underscore,
    /// `ce-id`, ...: Knative's RabbitMQ binding, the one Python's
    /// `cloudevents.core.bindings.rabbitmq` reads.
    Knative,
}

impl CloudEventsHeaders {
    /// Every layout, the default first: the consumer reads them in this order.
    pub const ALL: [CloudEventsHeaders; 3] = [
        CloudEventsHeaders::AmqpBinding,
        CloudEventsHeaders::Underscore,
        CloudEventsHeaders::Knative,
    ];

    /// The header name prefix: `cloudEvents:`, `cloudEvents_` or `ce-`.
    pub const fn prefix(self) -> &'static str {
        match self {
            CloudEventsHeaders::AmqpBinding => "cloudEvents:",
            CloudEventsHeaders::Underscore => "cloudEvents_",
            CloudEventsHeaders::Knative => "ce-",
        }
    }
}
