//! The order service's event contract: the committed baseline is what the code emits
//! (the breaking-change check, as a user puts it in their own suite), and the
//! document is valid AsyncAPI 3.0, checked by a JSON Schema validator against the
//! specification's own schema, in JSON and in YAML.

use outbox::contract::assert_compatible_with;
use outbox_examples::orders::{contract, contract_info, write_contract};
use serde_json::Value;

mod asyncapi;

use asyncapi::{errors, validator as asyncapi_validator};

const BASELINE: &str = "contracts/orders.asyncapi.json";

#[test]
fn the_event_contract_has_no_unrecorded_or_breaking_change() {
    assert_compatible_with(BASELINE, &contract_info());
}

#[test]
fn the_written_document_is_valid_asyncapi_3() {
    let validator = asyncapi_validator();
    let dir = std::env::temp_dir().join(format!("outbox-asyncapi-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir).expect("the fixture");
    let json_path = dir.join("orders.asyncapi.json");
    let yaml_path = dir.join("orders.asyncapi.yaml");
    write_contract(&json_path).expect("writes JSON");
    write_contract(&yaml_path).expect("writes YAML");
    let from_json: Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).expect("the fixture"))
            .expect("the fixture");
    let from_yaml: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(&yaml_path).expect("the fixture"))
            .expect("the YAML form parses");
    assert_eq!(
        from_yaml, from_json,
        "the YAML form says the same as the JSON form"
    );
    let found = errors(&validator, &from_json);
    assert!(found.is_empty(), "not valid AsyncAPI 3.0: {found:#?}");
    // With the CloudEvents headers listed too.
    let with_cloudevents =
        outbox::contract::asyncapi(&contract_info().cloudevents("ce_", "/orders-service"))
            .expect("the fixture");
    let found = errors(&validator, with_cloudevents.as_value());
    assert!(found.is_empty(), "not valid AsyncAPI 3.0: {found:#?}");
    // The committed baseline is valid too.
    let baseline: Value =
        serde_json::from_str(&std::fs::read_to_string(BASELINE).expect("the fixture"))
            .expect("the fixture");
    let baseline_errors = errors(&validator, &baseline);
    assert!(baseline_errors.is_empty(), "{baseline_errors:#?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The validator is not a rubber stamp: a document with a broken message is refused.
#[test]
fn the_validator_refuses_a_broken_document() {
    let validator = asyncapi_validator();
    let mut document = contract().expect("the fixture").as_value().clone();
    document["asyncapi"] = Value::from("2.6.0");
    document["channels"]["orders.events"]["messages"] = Value::from("not a map");
    let found = errors(&validator, &document);
    assert!(found.len() >= 2, "{found:#?}");
}

/// The document says what consumers need: the event, its key, its payload's fields.
#[test]
fn the_document_describes_order_confirmed() {
    let document = contract().expect("the fixture");
    let doc = document.as_value();
    let message = &doc["components"]["messages"]["OrderConfirmed"];
    assert_eq!(message["x-outbox-key"], "order_id");
    assert_eq!(
        message["payload"]["$ref"],
        "#/components/schemas/OrderConfirmed"
    );
    let payload = &doc["components"]["schemas"]["OrderConfirmed"];
    assert_eq!(payload["properties"]["order_id"]["format"], "uuid");
    assert_eq!(payload["properties"]["quantity"]["type"], "integer");
    assert_eq!(
        payload["required"],
        serde_json::json!(["order_id", "sku", "quantity"])
    );
    assert_eq!(doc["servers"]["local"]["protocol"], "kafka");
}
