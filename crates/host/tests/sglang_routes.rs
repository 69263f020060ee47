//! SGLang's `/{rank}/{op}` routes over HTTP, beside vLLM's, and the migration routes.

mod common;

use common::{Server, config};

fn post(s: &Server, path: &str, body: &str) -> common::Resp {
    s.post(path, body)
}

#[test]
fn every_route_answers_the_peers_json() {
    let s = Server::start(config());
    post(&s, "/0/initialize", r#"{"num_pages":4,"namespace":"kv"}"#).expect_no_content();
    post(&s, "/0/reserve_and_allocate_page_indices", r#"{"keys":[["h1",""],["h2",""]],"namespace":"kv"}"#)
        .expect_json(200, r#"{"indices":[[false,3],[false,2]]}"#);
    post(&s, "/0/confirm_write", r#"{"written_keys_to_confirm":[["h1",3]],"pages_to_release":[2],"namespace":"kv"}"#)
        .expect_no_content();
    post(&s, "/0/exists", r#"{"keys":["h1","h2"],"namespace":"kv"}"#).expect_json(200, r#"{"exists":[true,false]}"#);
    post(&s, "/0/get_page_indices", r#"{"keys":["h1","h2"],"namespace":"kv"}"#)
        .expect_json(200, r#"{"indices":[3,null]}"#);
    // A hit keeps its page; the released page 2 is on top of the stack.
    post(&s, "/0/reserve_and_allocate_page_indices", r#"{"keys":[["h1",""],["h3",""],["h3",""]],"namespace":"kv"}"#)
        .expect_json(200, r#"{"indices":[[true,3],[false,2],[false,2]]}"#);
    post(&s, "/0/delete_keys", r#"{"keys":["h1","nope"],"namespace":"kv"}"#).expect_no_content();
    post(&s, "/0/exists", r#"{"keys":["h1"]}"#).expect_json(200, r#"{"exists":[false]}"#);
    post(&s, "/0/clear", r#"{"namespace":"kv"}"#).expect_no_content();
    // Still initialized after clear, with every page free again (3 is handed out first).
    post(&s, "/0/reserve_and_allocate_page_indices", r#"{"keys":[["x",""]]}"#)
        .expect_json(200, r#"{"indices":[[false,3]]}"#);
    // Initializing again is ignored (the same size).
    post(&s, "/0/initialize", r#"{"num_pages":4}"#).expect_no_content();
}

#[test]
fn namespaces_ranks_and_the_vllm_routes_never_share_state() {
    let s = Server::start(config());
    post(&s, "/0/initialize", r#"{"num_pages":2,"namespace":"kv"}"#).expect_no_content();
    post(&s, "/0/initialize", r#"{"num_pages":2,"namespace":"mamba"}"#).expect_no_content();
    s.init(0, 2);
    post(&s, "/0/reserve_and_allocate_page_indices", r#"{"keys":[["k",""]],"namespace":"kv"}"#)
        .expect_json(200, r#"{"indices":[[false,1]]}"#);
    post(&s, "/0/confirm_write", r#"{"written_keys_to_confirm":[["k",1]],"namespace":"kv"}"#).expect_no_content();
    post(&s, "/0/exists", r#"{"keys":["k"],"namespace":"mamba"}"#).expect_json(200, r#"{"exists":[false]}"#);
    assert_eq!(s.exists(&["k"]), r#"{"exists":[false]}"#);
    // vLLM's pool on rank 0 is its own: FIFO from 0.
    assert_eq!(s.allocate(0, &["k"]), vec![("k".into(), 0)]);
    // vLLM's /clear leaves SGLang's pools alone.
    s.post("/clear", "").expect_no_content();
    post(&s, "/0/exists", r#"{"keys":["k"],"namespace":"kv"}"#).expect_json(200, r#"{"exists":[true]}"#);
    post(&s, "/1/exists", r#"{"keys":["k"],"namespace":"kv"}"#)
        .expect_detail(404, "Rank 1 namespace 'kv' not initialized. Please call /1/initialize first.");
}

#[test]
fn a_full_pool_answers_minus_one_never_a_5xx() {
    let s = Server::start(config());
    post(&s, "/3/initialize", r#"{"num_pages":2,"namespace":"kv"}"#).expect_no_content();
    post(&s, "/3/reserve_and_allocate_page_indices", r#"{"keys":[["a",""],["b",""],["c",""]],"namespace":"kv"}"#)
        .expect_json(200, r#"{"indices":[[false,1],[false,0],[false,-1]]}"#);
}

#[test]
fn import_and_export_of_sglangs_persistence_file() {
    let s = Server::start(config());
    let file = r#"{"0:kv": {"num_pages": 3, "free_pages": [0], "key_to_index": [["a", 2]]}}"#;
    let r = post(&s, "/admin/import/sglang", file);
    assert_eq!(r.status, 200, "{r:?}");
    let v = r.json();
    assert_eq!((v["pools"].as_u64(), v["keys"].as_u64(), v["leaked_pages"].as_u64()), (Some(1), Some(1), Some(1)));
    post(&s, "/0/get_page_indices", r#"{"keys":["a"]}"#).expect_json(200, r#"{"indices":[2]}"#);
    post(&s, "/admin/import/sglang", file).expect_detail(
        409,
        "kvpages already holds 1 SGLang pools; nothing was imported (add ?replace=true to drop them)",
    );
    post(&s, "/admin/import/sglang?replace=true", r#"{"0:kv": {"num_pages": 3, "free_pages": [5], "key_to_index": []}}"#)
        .expect_detail(400, "Invalid SGLang persistence file; nothing was imported (\"0:kv\".free_pages[0]: page 5 is out of range (the pool has 3 pages))");
    let exported = s.get("/admin/export/sglang");
    assert_eq!(exported.status, 200);
    assert_eq!(
        exported.json(),
        serde_json::json!({"0:kv": {"num_pages": 3, "free_pages": [1, 0], "key_to_index": [["a", 2]]}})
    );
}
