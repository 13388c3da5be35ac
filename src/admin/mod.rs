//! The admin API for the account team (`/admin/v1`, Bearer JWT), its OpenAPI document and
//! Swagger UI. Reads go to the store (read-your-writes on any gateway); writes are single
//! atomic catalog scripts that every gateway's mirror picks up within `refresh_ms`.

mod apply;
mod audit;
pub mod auth;
mod body;
mod clients;
mod export;
mod history;
mod hot;
mod jwks;
mod overrides;
mod plans;
mod safety;
mod shadow;
mod shared;
mod usage;

pub use usage::{LimitKindName, LimitUsage, UsageView};

use actix_web::dev::Payload;
use actix_web::middleware::from_fn;
use actix_web::{web, FromRequest, HttpMessage, HttpRequest};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_swagger_ui::SwaggerUi;

pub use auth::{Actor, JwtVerifier};

use crate::error::ApiError;

/// Registers `/admin/v1/...`, `/api-docs/openapi.json` and `/swagger-ui/`.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.service(
        web::scope("/admin/v1")
            .wrap(from_fn(auth::require_token))
            // A malformed query string is a 400 problem like every other error.
            .app_data(web::QueryConfig::default().error_handler(|e, _| {
                ApiError::BadRequest(format!("malformed query string: {e}")).into()
            }))
            .configure(catalog_resources)
            .configure(state_resources)
            .default_service(web::to(|| async {
                Err::<actix_web::HttpResponse, _>(ApiError::NotFound(
                    "no such admin resource".into(),
                ))
            })),
    )
    .service(
        // Behind a guard that compares the path's bytes: the router otherwise tries the
        // Swagger UI's pattern, a regex, against every forwarded request's path. It lets
        // through exactly what the UI's resources take (GET, their paths), so every other
        // request goes on to the routes after it as before.
        web::scope("")
            .guard(actix_web::guard::fn_guard(|ctx| {
                let head = ctx.head();
                head.method == actix_web::http::Method::GET && is_swagger_path(&head.uri)
            }))
            .service(
                SwaggerUi::new("/swagger-ui/{_:.*}")
                    .url("/api-docs/openapi.json", ApiDoc::openapi()),
            ),
    );
}

/// The catalog's resources: plans, clients, their keys and overrides.
fn catalog_resources(cfg: &mut web::ServiceConfig) {
    cfg.service(
        web::resource("/catalog")
            .get(export::get)
            .put(apply::put)
            .default_service(allow("GET, PUT")),
    )
    .service(
        web::resource("/plans")
            .get(plans::list)
            .default_service(allow("GET")),
    )
    .service(
        web::resource("/plans/{plan}")
            .get(plans::get)
            .put(plans::put)
            .delete(plans::delete)
            .default_service(allow("GET, PUT, DELETE")),
    )
    .service(
        web::resource("/clients")
            .get(clients::list)
            .default_service(allow("GET")),
    )
    .service(
        web::resource("/clients/{client}")
            .get(clients::get)
            .put(clients::put)
            .delete(clients::delete)
            .default_service(allow("GET, PUT, DELETE")),
    )
    .service(
        web::resource("/clients/{client}/keys")
            .post(clients::create_key)
            .default_service(allow("POST")),
    )
    .service(
        web::resource("/clients/{client}/keys/{key_id}")
            .delete(clients::revoke_key)
            .default_service(allow("DELETE")),
    )
    .service(
        web::resource("/clients/{client}/keys/{key_id}/roll")
            .post(clients::roll_key)
            .default_service(allow("POST")),
    )
    .service(
        web::resource("/clients/{client}/overrides")
            .get(overrides::list)
            .default_service(allow("GET")),
    )
    .service(
        web::resource("/clients/{client}/overrides/{limit}")
            .put(overrides::put)
            .delete(overrides::delete)
            .default_service(allow("PUT, DELETE")),
    );
}

/// The rest, read (and some reset) beside the catalog: a client's usage (now and its
/// history) and bucket, the
/// safety settings, the hot clients, shadow mode's comparisons, the audit log of writes.
fn state_resources(cfg: &mut web::ServiceConfig) {
    cfg.service(
        web::resource("/clients/{client}/usage")
            .get(usage::get)
            .default_service(allow("GET")),
    )
    .service(
        web::resource("/clients/{client}/usage/history")
            .get(history::get)
            .default_service(allow("GET")),
    )
    .service(
        web::resource("/clients/{client}/bucket")
            .get(clients::bucket)
            .delete(clients::refill)
            .default_service(allow("GET, DELETE")),
    )
    .service(
        web::resource("/safety")
            .get(safety::get)
            .put(safety::put)
            .default_service(allow("GET, PUT")),
    )
    .service(
        web::resource("/hot")
            .get(hot::hot)
            .default_service(allow("GET")),
    )
    .service(
        web::resource("/shadow")
            .get(shadow::get)
            .delete(shadow::reset)
            .default_service(allow("GET, DELETE")),
    )
    .service(
        web::resource("/audit")
            .get(audit::list)
            .default_service(allow("GET")),
    );
}

/// Whether the router would match the Swagger UI's resources (its files and the OpenAPI
/// document) to `uri`'s path, which it reads requoted as [`Url`] does; most paths have
/// no `%` and are read as they are.
fn is_swagger_path(uri: &actix_web::http::Uri) -> bool {
    let matches = |path: &str| path == "/api-docs/openapi.json" || path.starts_with("/swagger-ui/");
    if uri.path().contains('%') {
        matches(actix_web::dev::Url::new(uri.clone()).path())
    } else {
        matches(uri.path())
    }
}

/// A resource's answer to a method it does not have: `405` with `Allow`.
fn allow(methods: &'static str) -> actix_web::Route {
    web::to(move || async move {
        Err::<actix_web::HttpResponse, _>(ApiError::MethodNotAllowed(methods))
    })
}

/// The OpenAPI document, collected from the handlers' annotations.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "tollgate admin API",
        description = "Plans (each a set of limits: token buckets and quotas, some for one service only), \
            clients with their API keys, overrides and usage, safety limits and the audit log of the tollgate gateway. \
            Every call needs `Authorization: Bearer <JWT>`: `admin:read` for GET, `admin:write` for the rest. \
            Every error is `application/problem+json`.",
        license(name = "MIT")
    ),
    paths(
        plans::list, plans::get, plans::put, plans::delete,
        clients::list, clients::get, clients::put, clients::delete,
        clients::create_key, clients::revoke_key, clients::roll_key, clients::bucket,
        clients::refill,
        overrides::list, overrides::put, overrides::delete, usage::get, history::get,
        safety::get, safety::put,
        shadow::get, shadow::reset, hot::hot,
        audit::list, export::get, apply::put,
    ),
    components(schemas(
        crate::error::Problem,
        crate::error::FieldError,
        crate::domain::PlanName,
        crate::domain::ClientId,
        history::Step,
        history::Format,
    )),
    modifiers(&BearerAuth, &CommonResponses, &RollNeedsOneEnd, &KeyBodyOptional),
    tags(
        (name = "plans", description = "What each plan allows: its limits"),
        (name = "clients", description = "Clients, their plans, keys, overrides, usage and buckets"),
        (name = "safety", description = "Coarse per-service safety limits"),
        (name = "shadow", description = "Shadow-mode agreement with the services' own limiters"),
        (name = "audit", description = "Who changed what"),
        (name = "catalog", description = "The whole catalog at one version: exported, and applied from a file"),
    )
)]
pub struct ApiDoc;

/// Adds the Bearer scheme once, for every path's `security(("bearer" = []))`.
struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        let mut http = Http::new(HttpAuthScheme::Bearer);
        http.bearer_format = Some("JWT".to_string());
        components.add_security_scheme("bearer", SecurityScheme::Http(http));
    }
}

/// A roll's body gives exactly one of `overlap_s` and `old_expires_at` (`null` is the
/// same as leaving a field out): stated in the document, where a derived schema cannot.
struct RollNeedsOneEnd;

impl Modify for RollNeedsOneEnd {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::schema::{AllOfBuilder, ObjectBuilder, OneOfBuilder, Schema};
        use utoipa::openapi::schema::{SchemaType, Type};
        use utoipa::openapi::RefOr;

        let Some(components) = openapi.components.as_mut() else {
            return;
        };
        let Some(RefOr::T(body)) = components.schemas.remove("RollInput") else {
            return;
        };
        // `given` is there (not null); `other` is absent or null.
        let one = |given: &str, kind: Type, other: &str| {
            ObjectBuilder::new()
                .required(given)
                .property(
                    given,
                    ObjectBuilder::new().schema_type(SchemaType::Type(kind)),
                )
                .property(
                    other,
                    ObjectBuilder::new().schema_type(SchemaType::Type(Type::Null)),
                )
        };
        let ends = OneOfBuilder::new()
            .item(one("overlap_s", Type::Integer, "old_expires_at"))
            .item(one("old_expires_at", Type::String, "overlap_s"));
        let whole = AllOfBuilder::new().item(body).item(ends).build();
        components
            .schemas
            .insert("RollInput".to_string(), RefOr::T(Schema::AllOf(whole)));
    }
}

/// `POST /clients/{client}/keys` without a body makes a key (an empty body reads as `{}`),
/// which a derived operation cannot say: its body is marked not required.
struct KeyBodyOptional;

impl Modify for KeyBodyOptional {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let post = openapi
            .paths
            .paths
            .get_mut("/admin/v1/clients/{client}/keys")
            .and_then(|item| item.post.as_mut());
        if let Some(body) = post.and_then(|op| op.request_body.as_mut()) {
            body.required = Some(utoipa::openapi::Required::False);
        }
    }
}

/// The statuses every operation of a kind can answer, added in one place so no operation
/// misses one: the token's (`401`, `403`) and the store's (`503`) and `500` everywhere;
/// an invalid id in the path (`422`); a body's `400`, `413` and `422`; a query string's
/// `400` and `422`; `If-Match`'s and `If-None-Match`'s `400` and `412`. Each is a problem (`application/problem+json`).
/// Operations keep the statuses (and descriptions) their annotations give.
struct CommonResponses;

impl Modify for CommonResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for item in openapi.paths.paths.values_mut() {
            let ops = [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.patch,
            ];
            for op in ops.into_iter().flatten() {
                CommonResponses::add_to(op);
            }
        }
    }
}

impl CommonResponses {
    /// Adds to `op` the statuses its kind can answer that it does not list yet.
    fn add_to(op: &mut utoipa::openapi::path::Operation) {
        use utoipa::openapi::path::{Operation, ParameterBuilder, ParameterIn};
        use utoipa::openapi::schema::{ObjectBuilder, SchemaType, Type};
        use utoipa::openapi::Required;
        use utoipa::openapi::{ContentBuilder, HeaderBuilder, Ref, ResponseBuilder};

        let problem = |description: &str| {
            ResponseBuilder::new().description(description).content(
                "application/problem+json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("Problem")))
                    .build(),
            )
        };
        let add = |op: &mut Operation, status: &str, response: ResponseBuilder| {
            op.responses
                .responses
                .entry(status.to_string())
                .or_insert_with(|| response.build().into());
        };
        let string = || ObjectBuilder::new().schema_type(SchemaType::Type(Type::String));
        let params = op.parameters.iter().flatten();
        let in_path = params.clone().any(|p| p.parameter_in == ParameterIn::Path);
        let in_query = params.clone().any(|p| p.parameter_in == ParameterIn::Query);
        let if_match = params.clone().any(|p| p.name == "If-Match");
        if in_path {
            add(op, "422", problem("An id in the path is not a valid id"));
        }
        if in_query {
            add(op, "400", problem("A malformed query string"));
            add(op, "422", problem("An invalid query parameter, named"));
        }
        if op.request_body.is_some() {
            add(op, "400", problem("Malformed JSON, or not an object"));
            add(op, "413", problem("Body over 64 KiB"));
            add(op, "422", problem("Invalid fields, each named"));
        }
        if if_match {
            add(op, "400", problem("A malformed If-Match or If-None-Match"));
            for p in op.parameters.iter_mut().flatten() {
                if p.name == "If-Match" {
                    p.schema = Some(string().pattern(Some(body::IF_MATCH_PATTERN)).into());
                }
            }
            // Every write that takes If-Match takes If-Match's counterpart as well
            // (`src/admin/shared.rs`, `precondition`).
            let parameters = op.parameters.get_or_insert_with(Vec::new);
            if !parameters.iter().any(|p| p.name == "If-None-Match") {
                parameters.push(
                    ParameterBuilder::new()
                        .name("If-None-Match")
                        .parameter_in(ParameterIn::Header)
                        .required(Required::False)
                        .description(Some(
                            "Only if it does not exist (`*`: create-only), or is at none of \
                             these ETags (compared weakly); else 412",
                        ))
                        .schema(Some(string().pattern(Some(body::IF_MATCH_PATTERN))))
                        .build(),
                );
            }
            add(
                op,
                "412",
                problem("If-Match does not match the current version, or If-None-Match does"),
            );
        }
        add(
            op,
            "401",
            problem("Missing or invalid token").header(
                "WWW-Authenticate",
                HeaderBuilder::new()
                    .schema(string())
                    .description(Some(
                        "Bearer realm=\"tollgate-admin\", error=\"invalid_token\"",
                    ))
                    .build(),
            ),
        );
        add(
            op,
            "403",
            problem("The token lacks the scope (admin:read for GET, admin:write otherwise; admin:keys is enough to write a client's keys)"),
        );
        add(op, "500", problem("An internal error (logged)"));
        add(op, "503", problem("The store is unavailable"));
    }
}

/// The OpenAPI document as `tollgate openapi` prints it (and `openapi/openapi.json` holds).
pub fn openapi_json() -> String {
    let mut s = ApiDoc::openapi()
        .to_pretty_json()
        .expect("the OpenAPI document serializes");
    s.push('\n');
    s
}

impl FromRequest for Actor {
    type Error = ApiError;
    type Future = std::future::Ready<Result<Actor, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        std::future::ready(
            req.extensions()
                .get::<Actor>()
                .cloned()
                .ok_or_else(|| ApiError::InvalidToken("no authenticated caller".into())),
        )
    }
}
