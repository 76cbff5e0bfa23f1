//! The AsyncAPI 3.0.0 JSON Schema (see README.md here) as a validator.

use serde_json::Value;

/// A validator of AsyncAPI 3.0.0 documents.
pub fn validator() -> jsonschema::Validator {
    let schema: Value = serde_json::from_str(include_str!("asyncapi-3.0.0.schema.json"))
        .expect("the AsyncAPI schema is JSON");
    jsonschema::draft7::new(&schema).expect("the AsyncAPI schema compiles")
}

/// What `validator` finds wrong with `document`, with where.
pub fn errors(validator: &jsonschema::Validator, document: &Value) -> Vec<String> {
    validator
        .iter_errors(document)
        .map(|e| format!("{} at {}", e, e.instance_path))
        .collect()
}
